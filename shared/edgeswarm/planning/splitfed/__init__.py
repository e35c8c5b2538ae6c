"""Planning for SmartSplit's split federated learning (``train-splitfed``): the central manager's choice of each
round's participants and the cut of each one's model (spec ``smartsplit-split-fl.md`` section 4), the MEC's
importance scheduling (Algorithm 2) and the device's recomputation decisions (Algorithm 3). Pure: no I/O, no
torch."""
