"""Know before you run: memory per device and per host for every layout, and the layout `auto` picks."""
