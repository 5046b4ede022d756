"""Reproduction scoreboards: the papers' quantitative claims, each set against the number
fmoesim computes for it from the results store.

:mod:`~fmoesim.reproduce.claims` loads a paper's catalog of claims
(``claims/<paper>.yaml``), :mod:`~fmoesim.reproduce.score` computes fmoesim's effect for
each claim from the rows of its experiment preset, :mod:`~fmoesim.reproduce.report`
writes the scoreboard (CSV, Markdown, the docs page's table) and
:mod:`~fmoesim.reproduce.smallscale` rechecks the directions that hold on smaller runs.
"""
