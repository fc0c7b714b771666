"""Pull mode (`NixlConnector`): P prefills and leases its prompt blocks; D READs them.

The baseline push mode is measured against. Flow: the proxy sends the P leg
(`do_remote_decode`, max_tokens=1); P's finished request keeps its blocks and answers with
kv_transfer_params naming them (`params.prefill_answer`); the proxy forwards those to D;
D checks them against its prompt, preallocates the blocks it lacks, READs P's blocks
`[first_block_index, ...)` with NIXL, tells P it is done (`<P request id>:1`), recomputes
the last prompt token and decodes. P frees its blocks on that notification or when the
lease expires (`kv_lease_duration`, extended by D's `HB:<P request ids>`).

Modules:
- scheduler.py  PullScheduler — scheduler half, both roles (engine-core thread).
- params.py     P's answer and the D-leg decode (`validate_request_params`: the typed
                `kvconnector.params.PullDecodeLeg`, or HTTP 400 naming the field).
- signing.py    with a KV secret: P signs its answer, D admits only signed params for its
                prompt within P's lease (docs/security.md).
- meta.py       PullMeta (scheduler → worker each step), prompt digest.
- connector.py  assembly: `make_scheduler` builds PullScheduler, `make_worker` PullWorker
                (the shared `kvconnector.worker.NixlWorker` with Lender and Reader).
- thread.py     PullThread — the shared transfer thread's pull routes (`nixl-pull-transfer`).
- lender.py     P side: leases, heartbeats, completions, expiry.
- reader.py     D side: claims, handshakes (kvconnector.peers.Peers), READs, heartbeats.
"""
