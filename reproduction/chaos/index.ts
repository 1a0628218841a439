/**
 * The chaos suite's parts (issue 13's fault suite): hosts (network namespaces on a bridge, or
 * loopback), a cluster of real `shoal node` processes on them, bounded load through the `openai`
 * client, the faults, the verdict on each request and the receipt checks. `reproduction/chaos.ts`
 * runs the whole suite; `test/e2e/chaos.test.ts` runs a short loopback version in `npm test`.
 */
export { onCleanup } from './cleanup.ts'
export { createHosts, createLoopbackHosts, createNetnsHosts, netnsAvailable } from './hosts.ts'
export type { Host, Hosts } from './hosts.ts'
export { createCluster, shoal, SHOAL_BIN } from './cluster.ts'
export { createRelay, DelayLine } from './relay.ts'
export type { Impairment, Relay, RelayInit, RelayStats } from './relay.ts'
export type { ChaosNode, Cluster, ClusterInit, NodeSpec, NodeState } from './cluster.ts'
export { referenceTokens, runLoad, sendOne } from './load.ts'
export type { Acknowledged, LoadInit, LoadResult, LoadTarget } from './load.ts'
export { hang, killAndRestart, lossyLink, partition, slowLink, waitWhole, whole } from './faults.ts'
export type { FaultContext, FaultRecord, LossyLinkRecord } from './faults.ts'
export { checkLive, checkLogs } from './receipts.ts'
export type { LiveCheck, LogCheck } from './receipts.ts'
export { classifyFailure, classifySuccess, FAILURES, RETRYABLE_STATUSES, tally } from './verdict.ts'
export type { FailureFacts, Outcome, OutcomeKind, PhaseTally, SuccessFacts } from './verdict.ts'
