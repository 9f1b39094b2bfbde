from hotstart.forkserver.server import main

main()
