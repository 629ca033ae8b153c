"""The email family: the seed's ``email:send`` contract on Conveyor (issue 30)."""
