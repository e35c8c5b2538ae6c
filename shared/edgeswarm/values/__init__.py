"""The value types every layer shares, below all of them: model, data set and optimizer specs (``specs``), the
profiles a planner reads (``profiles``) and their caps (``limits``), checkpoint entries and their checks
(``checkpoints``). They import nothing of edgeswarm but the wire format's names and the errors."""
