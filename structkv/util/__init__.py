"""Utilities every layer may use and that use no other part of structkv: atomic files, fetching
wheels and Hub files, timing, the registry of compiled functions."""
