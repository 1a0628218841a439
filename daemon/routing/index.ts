/**
 * Routing: decides where a request runs and carries it there. Pure decisions (replica choice,
 * pipeline chain formation) over plain data the mesh's peer table is mapped onto; the
 * /shoal/infer/1.0.0 wire format; the forwarding client and server over libp2p streams; and the
 * routed InferenceService the ingress uses (local or forwarded, one invisible retry before start).
 */
export { chooseReplica, isSoleServer, rankReplicas, estimateCompletionMs, estimateStartMs, DEFAULT_POLICY } from './decision.ts'
export type { Candidate, LoadSnapshot, PrefixHoldings, RoutingContext, RoutingPolicy, RouteDecision, ChoiceReason } from './decision.ts'
export { DEFAULT_CHAIN_POLICY, formChain, runsKernels, uncovered } from './chain.ts'
export type { StageHolder, LayerRange, ChainContext, ChainPolicy, ChainDecision, ChainStage } from './chain.ts'
export { INFER_PROTOCOL, MAX_FRAME_BYTES, encodeFrame, decodePayload, decodeFrames } from './wire.ts'
export type { InferFrame } from './wire.ts'
export { forwardGenerate, PEER_LOST_IDLE_MS } from './client.ts'
export type { StreamOpener, ForwardOptions } from './client.ts'
export { handleInferStream } from './server.ts'
export type { InferHandlerOptions } from './server.ts'
export { createRoutedService } from './routed-service.ts'
export { joiningReason } from './joining.ts'
export type { RoutedService, RoutedServiceInit, RoutedServiceComponents } from './routed-service.ts'
export { preferPrefixHolder, planPrefixRoute, prefixHolderHint, keptPromptHash, withLearnedPrefixes, DEFAULT_PREFIX_ROUTE_POLICY } from './prefix-route.ts'
export type { LearnedPrefix, PrefixCandidate, PrefixPreference, PrefixRoute, PrefixRouteContext, PrefixRoutePolicy } from './prefix-route.ts'
export { ChainIncompleteError, ForwardError, PeerUnavailableError, RemoteError } from './errors.ts'
export type { ForwardPhase } from './errors.ts'
