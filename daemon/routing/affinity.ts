/**
 * Prefix affinity memory: which peer served a conversation's prompt prefix, so the next turn (the
 * same messages plus a reply and a new user message) can go where the prefix cache is warm.
 * Keys are hashes of the model and a message prefix; the table is a bounded LRU.
 */
import { createHash } from 'node:crypto'
import type { ChatMessage, GenerateRequest } from '../service.ts'

export interface AffinityTable {
  /** The peer that served the longest known prefix of this request's conversation. */
  lookup(request: GenerateRequest): string | undefined
  /** Remembers that `peerId` served this request (its whole conversation and its system prompt). */
  record(request: GenerateRequest, peerId: string): void
  readonly size: number
}

/** Prefixes tried per lookup, longest first (the first message is always tried too). */
const MAX_PROBES = 8

function key (model: string, messages: readonly ChatMessage[]): string {
  const h = createHash('sha256')
  h.update(model)
  for (const m of messages) h.update(`\u0000${m.role}\u0000${m.name ?? ''}\u0000${m.content}`)
  return h.digest('base64url')
}

export function createAffinityTable (init: { maxEntries?: number } = {}): AffinityTable {
  const max = init.maxEntries ?? 4096
  const table = new Map<string, string>()
  const put = (k: string, peerId: string): void => {
    table.delete(k)
    table.set(k, peerId)
    if (table.size > max) table.delete(table.keys().next().value as string)
  }
  return {
    lookup (request) {
      if (request.prompt.kind !== 'chat') return undefined
      const msgs = request.prompt.messages
      const lengths: number[] = []
      for (let n = msgs.length; n >= 1 && lengths.length < MAX_PROBES; n--) lengths.push(n)
      if (msgs.length > 1 && !lengths.includes(1)) lengths.push(1)
      for (const n of lengths) {
        const k = key(request.model, msgs.slice(0, n))
        const peer = table.get(k)
        if (peer !== undefined) {
          put(k, peer) // refresh its LRU position
          return peer
        }
      }
      return undefined
    },
    record (request, peerId) {
      if (request.prompt.kind !== 'chat' || request.prompt.messages.length === 0) return
      const msgs = request.prompt.messages
      put(key(request.model, msgs), peerId)
      if (msgs.length > 1) put(key(request.model, msgs.slice(0, 1)), peerId)
    },
    get size () { return table.size },
  }
}
