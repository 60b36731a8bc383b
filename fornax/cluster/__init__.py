"""fornax replicas on Ray: placed, restarted and autoscaled, with `fornax router` in front.

What runs where
- The driver (`fornax cluster up`, or `fornax serve --replicas N`) runs the controller
  (controller.py) and starts the router as a subprocess (`python -m fornax.cli router`), with
  a generated admin key for its /router/replicas routes. Clients talk to the router only.
  Replicas with keys get a generated admin key too; the router polls their /metrics and
  /v1/models with it (--replica-poll-key) and passes each client's own key on.
- Each replica is a Ray actor (actor.py: ReplicaActor) asking for `--threads-per-replica`
  CPUs, wherever Ray places it; the actor owns one `fornax serve` subprocess on a free port
  with `--num-threads` equal to those CPUs, so replicas do not fight over cores.
- Ray is the cluster manager and the RPC: placement, restarts, and the controller's calls to
  the actors (status, drain). There is no other channel; the router reaches replicas over
  their own HTTP API.

Restart semantics
- An actor that dies (its worker killed, its node lost, or its server exiting on its own,
  which makes the actor exit) is restarted by Ray up to `--max-restarts` times (-1: always).
  The new actor starts a new server on a new port; the controller, polling every actor each
  second, sees the new URL, adds it to the router and removes the old one. Calls in flight
  to the dead actor fail (not retried); requests in flight on its server are lost.
- The server dies with its actor: a watchdog in the child (child.py) notices the parent is
  gone, drains and exits, so no orphaned `fornax serve` outlives a killed actor.
- An actor dead for good (restarts used up) is dropped; below --min-replicas a new one is
  started.

Scaling rule (autoscaler.py, pure and clock-injected)
- Signal: the average `fornax:num_requests_waiting` over the ready replicas, read from their
  /metrics each second.
- Above `--target-waiting` for `--scale-up-delay` s: one more replica (up to the max).
- At or below `--scale-down-waiting` for `--scale-down-cooldown` s: one fewer (down to the
  min), the least loaded. No step while a replica is still starting or draining.
- Scaling down loses no request: the replica leaves the router first (no new requests;
  the router lets its in-flight ones finish), a grace second later gets SIGTERM (the server
  answers what it has, then exits), and only then is its actor killed.

Shutdown (SIGTERM/Ctrl-C at the driver): the control loop stops, every replica drains, the
router stops, and Ray is shut down if the controller started it.

Ray is imported lazily: `import fornax` never needs it (pip install 'fornax[cluster]').
"""
