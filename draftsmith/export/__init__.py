"""Export: writes a drafter checkpoint for hubs and serving engines (writer.py: folders, model cards, push to hub)
in the layouts the engines load (formats.py: each format's tensor names and config, both ways)."""
