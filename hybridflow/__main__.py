from hybridflow.cli import main

raise SystemExit(main())
