/**
 * Pipeline-sharded chains: a model split by layers across peers. A node serving one stage
 * (`--model SHARDDIR@A-B`) loads only that stage and answers /shoal/stage/2.0.0; the coordinator
 * (stage 0, with the tokenizer) forms a chain with daemon/routing's chain function and runs the
 * decode loop, its activations travelling stage to stage as binary frames over long-lived
 * multiplexed streams and only the sampled token id coming back. Many requests interleave through
 * one engine per stage; a lost stage is replayed on another holder or ends with a typed error.
 */
export { STAGE_PROTOCOL, STAGE_WIRE_VERSION, MAX_FRAME_BYTES, encodeFrame, encodePayloadParts, decodePayload } from './wire.ts'
export type { StageFrame, OpenBody, ChainHop, FinishKeep, StagePull } from './wire.ts'
export { ACCEPTED_ENCODINGS, ACTIVATION_ENCODINGS, chainEncoding, decodeActivation, encodeActivation, encodedBytes, roundTripActivation, toF16Bits } from './activations.ts'
export type { ActivationEncoding } from './activations.ts'
export type { LinkComponents } from './links.ts'
export { createStageNode } from './stage-node.ts'
export type { StageNode, StageNodeInit, StageNodeStats, TokenWatch } from './stage-node.ts'
export { createChainTokenSource } from './chain-source.ts'
export { checkDrafts } from './verify.ts'
export type { Verdict } from './verify.ts'
export type { ChainPrefix, ChainTokenSource, ChainTokenSourceInit } from './chain-source.ts'
export { chainPulls, chainScope, keepSkips, MAX_KEEP_SKIPS } from './chain-prefix.ts'
export { createKeptPrefixes } from './kept-prefixes.ts'
export { createKeepAcks, KEPT_WAIT_MS } from './keep-acks.ts'
export type { KeepAcks } from './keep-acks.ts'
export type { KeptPrefix, KeptPrefixes, KeptPrefixesStats } from './kept-prefixes.ts'
export { createPipelineStage, manifestHashOf } from './stage.ts'
export type { PipelineStage, PipelineStageInit, StageSpec } from './stage.ts'
export { createPipelineService } from './service.ts'
export type { ChainSourceWrapper, ChainWrapContext, PipelineService, PipelineServiceInit, PipelineServiceComponents, PipelineServiceStats } from './service.ts'
export { createLocalChain } from './local-chain.ts'
export type { LocalChain, LocalChainInit } from './local-chain.ts'
