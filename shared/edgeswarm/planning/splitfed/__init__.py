"""Planning for SmartSplit's split federated learning (``train-splitfed``): the central manager's choice of each
round's participants and the cut of each one's model (spec ``smartsplit-split-fl.md`` section 4), the MEC's
importance scheduling (Algorithm 2) and the device's recomputation decisions (Algorithm 3). Pure: no I/O, no
torch.

Modules: ``types`` (the contract), ``statistics`` (Dis, Stat), ``cost`` (memory, feasible cuts, round times,
bytes), ``objective`` (F and decode), ``solvers`` (exhaustive, global oracle, BO), ``plan`` (``plan_round``, the
entry), ``scheduling`` (Algorithm 2), ``recompute`` (Algorithm 3), ``synthetic`` (the paper's fleet, random
instances), ``quality`` (the BO check U6). Nothing is imported here, so reading ``types`` does not load
scikit-learn."""
