/**
 * The HTTP ingress: shoal's OpenAI-compatible API (chat completions, completions, models) plus
 * receipts, mesh status, health and Prometheus metrics. It validates and shapes HTTP only; an
 * `InferenceService` (daemon/service.ts) does the tokenizing and generating.
 */
export { createIngress } from './server.ts'
export type { DashboardSource, Ingress, IngressComponents, IngressInit, MeshView, ReceiptLookup } from './types.ts'
export { OFFLOAD_JSON_ABOVE_BYTES } from './json-body.ts'
export type { ClientAuth, ClientCheck } from './auth.ts'
