"""The operator lab (DESIGN.md section 5): tasks, a cheat-resistant evaluator, proposers
(offline search, LLM), a SQLite history, reports and export to the op registry."""
