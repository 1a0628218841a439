/** The ingress's init, components and public object. */
import type { FastifyInstance } from 'fastify'
import type { Logger } from 'pino'
import type { Registry } from 'prom-client'
import type { InferenceService } from '../service.ts'
import type { ClientAuth } from './auth.ts'

/** Signed receipts by id, for GET /v1/receipts/{id}. */
export interface ReceiptLookup {
  /** The signed receipt document, or undefined when there is none with that id. */
  get (id: string): Promise<unknown | undefined>
}

/** The mesh as this node sees it, for GET /v1/mesh. */
export interface MeshView {
  snapshot (): unknown
}

/** What the dashboard shows (GET /, /dashboard/state, /dashboard/events, /dashboard/receipts/:id/verify). */
export interface DashboardSource {
  /** The whole state the page renders (a JSON value). */
  state (): Promise<unknown>
  /** One receipt's verification, or undefined when there is no receipt with that id. */
  verify (id: string): Promise<unknown | undefined>
  /** Calls `listener` when something the page shows changed (a peer joined or left); returns unsubscribe. */
  onChange? (listener: () => void): () => void
}

/** The ingress's limits (DEFAULT_INGRESS_LIMITS). */
export interface IngressLimits {
  /** Largest request body. Default 8 MiB. */
  bodyLimitBytes: number
  /** Completions running at once before 429. Default 64. */
  maxConcurrentRequests: number
  /** How long stop() lets running completions finish before aborting them. Default 30 s. */
  drainTimeoutMs: number
  /**
   * Time to receive a whole request (not to answer it), so slow senders cannot hold sockets
   * forever (fastify's default 0 would let them). Default 120 s.
   */
  receiveTimeoutMs: number
}

export interface IngressInit extends Partial<IngressLimits> {
  /** Default 127.0.0.1. */
  host?: string
  /** Default 0 (any free port). */
  port?: number
  /** Deadline of one completion. Default 10 minutes. */
  requestTimeoutMs?: number
  /** A pino logger, or false for none. Default: fastify's pino logger at info level. */
  logger?: Logger | false
  /** HTTPS with the operator's certificate chain and private key (PEM); plain HTTP without it. */
  tls?: { cert: string | Buffer, key: string | Buffer }
}

export interface IngressComponents {
  service: InferenceService
  receipts?: ReceiptLookup
  mesh?: MeshView
  /** When given, the node serves the dashboard page at GET /. */
  dashboard?: DashboardSource
  /** Where the ingress registers its metrics and what /metrics serves. Default: a new Registry. */
  metrics?: Registry
  /**
   * Client keys: when given, every /v1/* request and the dashboard's data routes (/dashboard/*)
   * need a valid bearer key (else 401); /, /healthz and /metrics stay open.
   */
  auth?: ClientAuth
}

export interface Ingress {
  start (): Promise<{ url: string }>
  /** 503 for new requests, lets running ones finish (bounded), then closes the server. */
  stop (): Promise<void>
  /** Completions running now (what a stop would drain). */
  readonly inFlight: number
  /** The fastify instance, for inject() in tests. */
  readonly app: FastifyInstance
}
