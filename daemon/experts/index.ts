/**
 * Experts: mixture-of-experts layers whose experts live on other nodes. A stage node runs a MoE
 * layer's attention and router; expert holders keep the experts resident and answer with weighted
 * partial sums. Here: the placement decision (which holder keeps which experts, from gossiped
 * memory and a routing histogram), the per-step dispatch decision (which rows go to which holder,
 * replicas taking over from excluded holders) and the combine, all pure; the expert size of a
 * shard; the /shoal/experts/2.0.0 wire format; a holder answering compute frames from
 * expert-parallel shards (shards/expert-shards.ts); and the stage side of one layer step
 * (runExpertStep: dispatch, send, combine, fail over to replicas), over libp2p streams
 * (serveExperts, createExpertLinks). For the daemon: expert-parallel shard directories
 * (openExpertShards: layout and key) and the stage node's InferenceService (createExpertService:
 * attention and router here, experts on the holders the mesh gossips, steps of concurrent
 * requests batched into one expert step per layer).
 */
export { placeExperts } from './placement.ts'
export type { PlacementInput, PlacementNode, PlacementDecision, ExpertPlan, LayerPlacement, NodePlacement } from './placement.ts'
export { dispatchRows, combinePartials, expertBytes } from './dispatch.ts'
export type { DispatchDecision, DispatchOptions } from './dispatch.ts'
export { encodeFrame, encodePayloadParts, decodePayload } from './wire.ts'
export type { ExpertFrame, ExpertGroup } from './wire.ts'
export { createExpertHolder } from './holder.ts'
export type { ExpertHolder, ExpertHolderInit } from './holder.ts'
export { runExpertStep } from './step.ts'
export { serveExperts, createExpertLinks } from './transport.ts'
export { createExpertParallelRunner } from './runner.ts'
export type { ExpertParallelRunner, ExpertParallelRunnerInit, GreedyResult } from './runner.ts'
export type { ExpertTransportComponents } from './transport.ts'
export type { ExpertLink, ExpertStepInput, ExpertStepResult } from './step.ts'
export { ExpertWireError, ExpertsLostError, ExpertsUnplaceableError } from './errors.ts'
export { openExpertShards, isExpertShardDir, LAYOUT_FILE } from './shards-dir.ts'
export type { ExpertShards } from './shards-dir.ts'
export { createExpertService } from './service.ts'
export type { ExpertService, ExpertServiceInit, ExpertServiceComponents, ExpertServiceStats, ExpertPlanView } from './service.ts'
export type { ExpertWireErrorCode } from './errors.ts'
