from rlasync.cli import main

raise SystemExit(main())
