"""Trained drafters: the networks (``networks``), their files and the published layouts they load from
(``checkpoint``). Their proposers live in ``exactspec.proposers``; their training in ``exactspec.train``."""
