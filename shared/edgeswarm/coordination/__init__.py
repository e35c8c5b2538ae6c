"""The coordinator's side of every workload, written once: the request fan-out to a job's devices
(``fanout``), the planner client with its busy retry (``planner_client``) and the job skeleton with its hooks
(``program``: profile, plan, deploy to every device, watch liveness, re-plan on loss)."""
