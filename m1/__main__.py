from m1.cli import app

app()
