"""meshwatch node agent. Imports nothing from app/."""
