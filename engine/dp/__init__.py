"""Data parallelism: N EngineCore processes behind one frontend (seed 000).

- config.py       validation of the data_parallel_* settings, per-rank configs
- messages.py     msgspec messages between engines, the coordinator and the frontend
- coordinator.py  the coordinator process: collects engine stats, republishes them to the
                  frontend at a fixed interval, runs the request-wave protocol
- engine_link.py  the engine side of the coordinator sockets
- lockstep.py     the busy loop of engines that must step together (waves, dummy steps)
- balancer.py     the load-balancing choice (score = waiting * 4 + running)
The frontend client is engine/client/dp_lb_client.py.
"""
