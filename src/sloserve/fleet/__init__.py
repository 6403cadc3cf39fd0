"""A fleet behind one endpoint: ``sloserve serve --replicas N`` runs N engine replicas on Ray Serve
(``replica``: the deployment), routes each request with the simulator's routing policies
(``routing``: Ray Serve's request router) and serves them through the single server's app
(``engine``: ``FleetEngine``, an ``AsyncLLMEngine`` over Ray Serve calls). Needs the fleet extra
(``pip install 'sloserve[fleet]'``); nothing here is imported without ``--replicas``."""
