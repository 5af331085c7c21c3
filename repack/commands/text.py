"""The `repack text` command. Imports nothing heavy."""

from __future__ import annotations

from pathlib import Path

import click

from repack.commands.options import (LOCATION, ProcessEnd, engine_options, job_command, location, run_job,
                                     source_options, split_engine_options)
from repack.config import parse_size


@job_command("text", input=("field", "doc_per", "list_file"),
             output=("tokenize", "tokenizer", "append_eos", "eos_token", "add_bos", "bos_token",
                     "no_special_tokens", "name", "chunk_bytes", "append", "no_merge"),
             checking=("max_doc_bytes",))
@click.argument("source", type=LOCATION)
@click.argument("out", type=LOCATION)
@click.option("--tokenize", default="memmap", show_default=True, type=click.Choice(["memmap"]),
              help="Output: Megatron-LM .bin/.idx token memmap.")
@click.option("--tokenizer", "tokenizer", required=True,
              help="A local HuggingFace tokenizer.json, a model folder holding one, or a HuggingFace cache folder "
                   "(~/.cache/huggingface/hub/models--org--name); never downloaded.")
@click.option("--field", default="text", show_default=True, help="JSON-lines key / parquet column of the text.")
@click.option("--doc-per", type=click.Choice(["line", "file", "blank-line"]), default="line", show_default=True,
              help=".txt inputs: one document per line, per file, or per blank-line-separated paragraph.")
@click.option("--list", "list_file", is_flag=True,
              help="SOURCE is a file naming the inputs, one per line (surrounding whitespace stripped; blank lines "
                   "and lines starting with # skipped).")
@click.option("--append-eos/--no-append-eos", default=True, show_default=True,
              help="End every document with the EOS token.")
@click.option("--eos-token", default=None, help="EOS token (default: found among the special tokens).")
@click.option("--add-bos", is_flag=True, help="Start every document with the BOS token.")
@click.option("--bos-token", default=None, help="BOS token (default: found among the special tokens).")
@click.option("--no-special-tokens", is_flag=True,
              help="Do not add the tokenizer template's special tokens (Megatron's --tokenizer-hf-no-include-"
                   "special-tokens).")
@click.option("--name", default="text_document", show_default=True, help="Output prefix: OUT/NAME.bin/.idx.")
@click.option("--chunk-bytes", default="auto", show_default=True,
              help="Input bytes per task, one part each (auto: corpus/256, within 0.5MB..256MB).")
@click.option("--append", is_flag=True,
              help="OUT holds a token dataset: tokenize only the files it does not hold yet (same path, size and "
                   "mtime) into a new prefix and publish it as the dataset's next version.")
@click.option("--no-merge", is_flag=True, help="Keep one prefix per part (Megatron weighted --data-path list).")
@click.option("--max-doc-bytes", default="8MiB", show_default=True,
              help="Quarantine documents longer than SIZE (bounds each worker's memory: a document is tokenized "
                   "whole, at about 105 bytes of memory per byte of text; at most 16MiB).")
@source_options
@engine_options
def text(source, out, tokenize, tokenizer, field, doc_per, list_file, append_eos, eos_token, add_bos, bos_token,
         no_special_tokens, name, chunk_bytes, append, no_merge, max_doc_bytes, no_follow, allow_outside, **kwargs):
    """Tokenize the text corpus SOURCE (.jsonl/.txt/.parquet, .gz/.zst; file, folder or --list) into OUT."""
    from repack.jobs.text import TextJob, TextSpec

    options = split_engine_options(kwargs)
    spec = TextSpec(source=location(source), out=location(out), tokenize=tokenize,
                    tokenizer=str(Path(tokenizer).expanduser().absolute()), field=field, doc_per=doc_per, list_file=list_file,
                    append_eos=append_eos, eos_token=eos_token, add_bos=add_bos, bos_token=bos_token,
                    special_tokens=not no_special_tokens, name=name, chunk_bytes=None if chunk_bytes == "auto" else parse_size(chunk_bytes),
                    merge=not no_merge, max_doc_bytes=parse_size(max_doc_bytes), follow_symlinks=not no_follow,
                    allow_outside_source=allow_outside)
    if append:
        from repack.commands.versions import run_append

        run_append(spec, options)
        return
    run_job(TextJob(spec), options)
    from repack.store import is_remote

    if options.executor == "local" and not is_remote(spec.out):
        ProcessEnd.quick = True  # the pool is joined, finalize's threads too: no interpreter teardown after the summary
