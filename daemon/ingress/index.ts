/**
 * The HTTP ingress: shoal's OpenAI-compatible API (chat completions, completions, models) plus
 * receipts, mesh status, health and Prometheus metrics. It validates and shapes HTTP only; an
 * `InferenceService` (daemon/service.ts) does the tokenizing and generating.
 */
export { createIngress, DEFAULT_INGRESS_LIMITS } from './server.ts'
export type { DashboardSource, Ingress, IngressComponents, IngressInit, IngressLimits, MeshView, ReceiptLookup } from './types.ts'
export { RequestError } from './errors.ts'
export { OFFLOAD_JSON_ABOVE_BYTES } from './json-body.ts'
export type { ClientAuth, ClientCheck } from './auth.ts'
