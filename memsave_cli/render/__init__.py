"""Renderers of results: Rich tables for people, CSV for spreadsheets (JSON is ``Report.to_json``)."""
