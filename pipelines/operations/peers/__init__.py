"""The operations family's local peers over real HTTP on loopback: the web ERP
(:mod:`pipelines.operations.peers.erp`) its syncs and writes drive in a headless browser."""
