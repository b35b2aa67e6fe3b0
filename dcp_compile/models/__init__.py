"""Models that ship with the library: the demo model (paged attention), an ordinary
Llama-style model (plain) and an ordinary MLA model (mla)."""
