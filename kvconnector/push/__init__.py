"""Push mode: D registers preallocated blocks with P; P WRITEs its prefill KV into them.

Modules:
- scheduler.py  PushScheduler — scheduler half (engine-core thread). D: asks for every
                prompt token it lacks (async), stages a `Registration`, arms the watchdog
                (`push_registration_timeout`), reports `watchdog_expired`. P: on finish of a
                `do_remote_decode` request keeps the blocks (delay-free) and stages
                `FinishedBlocks`; an aborted one becomes `aborted`. Every remote request's
                blocks (P and D) are freed only when the worker reports the id in
                `finished_sending` — only the worker knows when no WRITE can touch them.
- meta.py       PushMeta — what the scheduler half hands the worker each step.
- connector.py  assembly: `make_scheduler` builds PushScheduler, `make_worker` PushWorker
                (the shared `kvconnector.worker.NixlWorker` with Sender and Receiver).
- thread.py     PushThread — the shared transfer thread's push routes (`nixl-push-transfer`):
                which metadata field and which notification goes to which half.
- sender.py     P side: one `Staged` per P request, in one `SendState` (STAGED, MATCHED,
                WRITING); registrations P holds; matching (by transfer_id when both
                sides carry one, else —
                neither does, vLLM's push protocol — exact id, then base id; always the
                same prompt digest, PUSH_FAIL otherwise), leases extended by HB (transfer
                id or base request id), WRITE posting with completion `<D id>:<tp>`,
                PUSH_FAIL when P will not write (any error on the send path included),
                PUSH_CANCEL handling (ACK only once no WRITE can land), tombstones for
                transfers P gave up on (a late PUSH_REG gets PUSH_FAIL), ttl guard (no
                WRITE for a registration older than `push_registration_timeout`).
- receiver.py   D side: one `Recv` per request, in one `RecvState` (QUEUED, UNSENT,
                WAITING, QUARANTINED, SAFE); handshake then PUSH_REG, heartbeats while
                queued or waiting,
                completion → finished_recving, PUSH_FAIL / watchdog / dead P →
                failed_recving (the scheduler applies `kv_load_failure_policy`),
                quarantine after PUSH_CANCEL until ACK or `2 * ttl + grace` since sending.

Shared with pull mode (kvconnector/): the worker shell (worker.py), the transfer thread
(transfer_thread.py), peers and liveness probes (peers.py), the outbox (outbox.py), the
scheduler-half base (scheduler_half.py). The state machines: docs/design.md §6.
"""
