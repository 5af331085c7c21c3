from repack.entry import main

main()
