"""Test kit: SGLang-shaped test doubles, a real redis-server launcher, the bounded lifecycle model. Shared by tests/ and bench/."""
