/**
 * The contract between the HTTP ingress and whatever executes a request: a local engine, a
 * forwarding client to a peer, or a pipeline chain. The ingress validates and shapes HTTP; the
 * service tokenizes (the model's own tokenizer and chat template live with the model), generates
 * and reports. Errors thrown before the `start` event become HTTP errors (see daemon/errors.ts);
 * errors after it end the stream with an OpenAI-shaped error event.
 */

export interface ChatMessage {
  role: string
  content: string
  name?: string
}

export type PromptInput =
  | { kind: 'chat', messages: ChatMessage[] }
  | { kind: 'text', text: string }
  /** Token ids as given: no BOS is added. */
  | { kind: 'tokens', ids: number[] }

export interface SamplingParams {
  /** 0 means greedy. */
  temperature: number
  topP: number
  seed?: number
}

export interface GenerateRequest {
  /** Unique per request; also the receipt id. */
  requestId: string
  model: string
  prompt: PromptInput
  /** Upper bound on generated tokens; undefined means up to the model's context limit. */
  maxTokens?: number
  sampling: SamplingParams
  stop: string[]
  /** Epoch milliseconds after which the request fails with SHOAL_ERR_DEADLINE. */
  deadline: number
  /**
   * The client API key that asked (ingress with --require-keys), for the receipt. Stays on the
   * ingress node: it is not part of the forwarded request.
   */
  client?: ClientIdentity
  /**
   * Set by routing when it sends the request to a node that lacks the prompt's cached prefix
   * while another peer holds it (that holder being overloaded, suspect or slower): the node that
   * runs the request may pull that KV (/shoal/kv/1.0.0) instead of prefilling it, when its own
   * cache misses and the cost model says the transfer pays.
   */
  prefixHolder?: PrefixHolderHint
  /**
   * Set by routing when it sends the request to the last node that could take it (no other node
   * serves the model, or every other one was tried). That node then queues it until its deadline
   * instead of refusing it for its latency budget: a refusal is what lets routing place a request
   * elsewhere, and with nowhere else it only makes the client wait and retry.
   */
  soleServer?: true
  /**
   * Set only by the node's own start-up warm-up (daemon/node/warm-up.ts), never from a client or
   * a peer: the engine runs it like any request but keeps none of its KV as a prefix and notes
   * nothing of its speed, so it leaves nothing a later request or a router could see.
   */
  warmUp?: true
}

/** Prompt tokens whose KV a node took from its prefix cache instead of prefilling them. */
export interface PrefixReuse {
  /** The node that reused them. */
  peerId: string
  reusedTokens: number
  /**
   * Set when that KV was first pulled from another node's cache (/shoal/kv/1.0.0): that node (on a
   * rebuilt chain: the peers its moved stages pulled their layers from, comma-separated).
   */
  movedFrom?: string
}

/** A peer that probably holds a prompt's prefix in its KV cache (from its load reply's summary). */
export interface PrefixHolderHint {
  peerId: string
  /** Prompt tokens it holds, by its summary (a lower bound up to the summary's sampling). */
  cachedTokens: number
}

/** Who asked: a client key's name and serial, as the CA issued it. */
export interface ClientIdentity {
  name: string
  serial: string
}

export type FinishReason = 'stop' | 'length'

export interface RouteHop {
  peerId: string
  /** Inclusive layer range when the hop ran one pipeline stage. */
  layers?: [number, number]
}

export interface Usage {
  promptTokens: number
  completionTokens: number
}

export type GenerateEvent =
  /** Sent once, before any token: what the ingress needs for headers. */
  | {
    type: 'start'
    promptTokenIds: number[]
    route: string[]
    receiptId: string
    /** Identifies the exact weights that ran (sha256 of the shard manifest), for the receipt. */
    manifestHash?: string
    /** The route with each hop's layer range (pipeline stages); defaults to `route` without layers. */
    hops?: RouteHop[]
    /** What the executing node's KV prefix cache did for this prompt (absent: nothing reused). */
    prefix?: PrefixReuse
  }
  /** Text that is safe to show (never half a UTF-8 character) and the token ids behind it. */
  | { type: 'delta', text: string, tokenIds: number[] }
  /** `receiptParts`: signed shares of the work from each executing peer (forwarded or pipelined). */
  | { type: 'end', finishReason: FinishReason, usage: Usage, receiptParts?: unknown[], speculation?: SpeculationSummary }

/** What speculative decoding did for one request: the drafter and its proposed and accepted tokens. */
export interface SpeculationSummary {
  drafter: string
  drafted: number
  accepted: number
}

export interface ModelCard {
  id: string
  /** Unix seconds. */
  created: number
  ownedBy: string
  /** Maximum context length in tokens. */
  contextLength: number
  /** Free-form notes shown in /v1/models, e.g. "random weights (demo)". */
  description?: string
  /** Where the model runs: peer ids or "local". */
  servedBy?: string[]
}

export interface InferenceService {
  models(): ModelCard[]
  /** Throws a ShoalError (SHOAL_ERR_MODEL_NOT_FOUND, SHOAL_ERR_CONTEXT_LENGTH, …) before `start`. */
  generate(request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent>
}
