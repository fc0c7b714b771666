from engine.worker.kernels import main

raise SystemExit(main())
