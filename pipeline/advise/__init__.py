"""``trtpipe recipe new``: the search space the planner can judge (:mod:`.space`), judging and ranking with ties
(:mod:`.search`), the table / JSON / commented recipe (:mod:`.render`), the run and ``--verify`` (:mod:`.workflow`,
:mod:`.verify`). docs/recipe-new.md describes it."""
