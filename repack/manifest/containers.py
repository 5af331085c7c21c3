"""The containers a video input or a prepared video may be opened as (FFmpeg demuxer names): single-file
containers only, so a playlist or reference demuxer (HLS, DASH, concat, image2 sequences, ...) never opens
another file, whatever the file's name. The producer's ffmpeg/PyAV calls (``repack.transforms.ffmpeg_cli``)
and the video readers (``pipelines.torch_video``) open files with this list."""

ALLOWED_FORMATS = ("mov", "mp4", "matroska", "webm", "avi", "mpegts", "mpeg", "flv", "asf", "ogg", "ivf", "nut",
                   "mxf", "dv", "m4v", "h264", "hevc", "mpegvideo", "obu", "mjpeg", "gif", "jpeg_pipe", "png_pipe",
                   "webp_pipe", "bmp_pipe", "gif_pipe")
SAFE_INPUT_OPTIONS = {"protocol_whitelist": "file", "format_whitelist": ",".join(ALLOWED_FORMATS)}
