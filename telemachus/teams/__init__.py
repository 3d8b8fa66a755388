"""Teams, members and who may do what: RBAC, team and user writes, their API, sign-in limits."""
