/**
 * Routing: decides where a request runs and carries it there. Pure decisions (replica choice,
 * pipeline chain formation) over plain data the mesh's peer table is mapped onto; the
 * /shoal/infer/1.0.0 wire format; the forwarding client and server over libp2p streams; and the
 * routed InferenceService the ingress uses (local or forwarded, one invisible retry before start).
 */
export { chooseReplica, rankReplicas, estimateCompletionMs, estimateStartMs, DEFAULT_POLICY } from './decision.ts'
export type { Candidate, LoadSnapshot, PrefixHoldings, RoutingContext, RoutingPolicy, RouteDecision, ChoiceReason } from './decision.ts'
export { formChain, uncovered, DEFAULT_CHAIN_POLICY } from './chain.ts'
export type { StageHolder, LayerRange, ChainContext, ChainPolicy, ChainDecision, ChainStage } from './chain.ts'
export {
  INFER_PROTOCOL, INFER_WIRE_VERSION, MAX_FRAME_BYTES, MAX_REQUEST_ID_BYTES,
  encodeFrame, encodePayload, decodePayload, decodeFrames,
} from './wire.ts'
export type { InferFrame, InferFrameKind } from './wire.ts'
export { forwardGenerate, DEFAULT_FIRST_FRAME_TIMEOUT_MS, DEFAULT_IDLE_TIMEOUT_MS, PEER_LOST_IDLE_MS } from './client.ts'
export type { StreamOpener, ForwardOptions } from './client.ts'
export { handleInferStream, withRouteHop, DEFAULT_REQUEST_TIMEOUT_MS } from './server.ts'
export type { InferHandlerOptions } from './server.ts'
export { createRoutedService } from './routed-service.ts'
export type { RoutedService, RoutedServiceInit, RoutedServiceComponents } from './routed-service.ts'
export { preferPrefixHolder, planPrefixRoute, prefixHolderHint, keptPromptHash, withLearnedPrefixes, DEFAULT_PREFIX_ROUTE_POLICY } from './prefix-route.ts'
export type { LearnedPrefix, PrefixCandidate, PrefixPreference, PrefixRoute, PrefixRouteContext, PrefixRoutePolicy } from './prefix-route.ts'
export { createAffinityTable } from './affinity.ts'
export type { AffinityTable } from './affinity.ts'
export {
  InferWireError, OverloadedError, NoEligibleNodeError, ModelNotFoundError, ChainIncompleteError,
  ForwardError, PeerUnavailableError, PeerLostError, DeadlineExceededError, ForwardAbortedError,
  RemoteError, RequestTooLargeError, RETRYABLE_CODES, isRetryable,
} from './errors.ts'
export type { InferWireErrorCode, ForwardPhase } from './errors.ts'
