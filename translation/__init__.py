"""Translating with a trained run on one process: text files, and a prepared split scored with sacreBLEU."""
