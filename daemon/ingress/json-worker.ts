/**
 * JSON body worker entry: decodes and parses request bodies too large to parse on the event loop
 * (8 MB of JSON holds it for ~50-100 ms), with the same refusals as fastify's own parser
 * (`__proto__` keys, `constructor.prototype`). Protocol (json-body.ts): {id, bytes} in;
 * {id, value} or {id, error} out.
 */
import { parentPort } from 'node:worker_threads'
import type { JsonReply, JsonRequest } from './json-body.ts'

if (parentPort === null) throw new Error('daemon/ingress/json-worker.ts must run in a worker thread')
const port = parentPort
const decoder = new TextDecoder()

/** True when the value carries prototype-poisoning keys (what secure-json-parse refuses). */
function poisoned (value: unknown): boolean {
  const stack: unknown[] = [value]
  while (stack.length > 0) {
    const v = stack.pop()
    if (typeof v !== 'object' || v === null) continue
    if (Array.isArray(v)) { for (const x of v) stack.push(x); continue }
    if (Object.hasOwn(v, '__proto__')) return true
    const c = (v as Record<string, unknown>).constructor
    if (Object.hasOwn(v, 'constructor') && typeof c === 'object' && c !== null && Object.hasOwn(c, 'prototype')) return true
    for (const x of Object.values(v)) stack.push(x)
  }
  return false
}

port.on('message', (msg: JsonRequest) => {
  let reply: JsonReply
  try {
    const value: unknown = JSON.parse(decoder.decode(msg.bytes))
    reply = poisoned(value) ? { id: msg.id, error: 'poisoned' } : { id: msg.id, value }
  } catch {
    reply = { id: msg.id, error: 'invalid' }
  }
  try {
    port.postMessage(reply)
  } catch {
    // Structured cloning recurses: a value nested ~a million deep cannot be sent back.
    port.postMessage({ id: msg.id, error: 'too-deep' } satisfies JsonReply)
  }
})
