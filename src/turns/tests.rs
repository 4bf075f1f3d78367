// Unit and property tests of the turn contract (pure, fake clock).
