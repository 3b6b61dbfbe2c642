"""Protocol schemas (.proto sources) and the Python modules generated from them."""
