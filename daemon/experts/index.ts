/**
 * Experts: mixture-of-experts layers whose experts live on other nodes. A stage node runs a MoE
 * layer's attention and router; expert holders keep the experts resident and answer with weighted
 * partial sums. Here: the placement decision (which holder keeps which experts, from gossiped
 * memory and a routing histogram), the per-step dispatch decision (which rows go to which holder,
 * replicas taking over from excluded holders) and the combine, all pure; the expert size of a
 * shard; the /shoal/experts/1.0.0 wire format; a holder answering compute frames from
 * expert-parallel shards (shards/expert-shards.ts); and the stage side of one layer step
 * (runExpertStep: dispatch, send, combine, fail over to replicas), over libp2p streams
 * (serveExperts, createExpertLinks).
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
