"""What reaches llguidance and how: pure-Python bounds on constraints (sizes, depths, rule
chains, literals, satisfiability), the compile worker processes where a crash costs one request,
big-stack compile threads, and the byte-bounded cache of compiled grammars. Imports nothing
heavier than llguidance and NumPy: the worker process runs on this package alone."""
