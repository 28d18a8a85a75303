"""Training drafters against a frozen target: the target's own outputs as data (``targetdata``), the drafters'
losses and loop (``loop``), and the command (``command``)."""
