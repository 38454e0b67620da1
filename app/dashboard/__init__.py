"""Static files of the web dashboard (a package so that they are installed with the app)."""
