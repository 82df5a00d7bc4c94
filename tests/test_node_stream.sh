#!/usr/bin/env bash
# tests/test_node.sh with the master's "lsc": "stream": its layer stream cache within its KV budget
# (SwiftCache Eq. 1-5, issue 10), the coordinator capping the workers' offers at what the LSC streams,
# and the budget checked at every stage from kvbankctl status.
KVB_NODE_LSC=stream exec bash "$(dirname "$0")/test_node.sh" "$@"
