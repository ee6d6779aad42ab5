"""The transformers side of TaSQ: ``cache`` (a ``transformers`` cache that stores codes, with the
same window rule as the server) and ``baselines`` (the KV methods it runs, TaSQ's rivals
included, behind one :class:`baselines.KVMethod` interface)."""
