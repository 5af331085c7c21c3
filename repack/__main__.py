from repack.cli import main

main()
