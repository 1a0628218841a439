/**
 * The ingress compiles its body schemas without checking them against JSON Schema's meta-schema
 * (server.ts: it cost every start ~40 ms); this checks them once, with fastify's own compiler and
 * its defaults, which refuse a schema the meta-schema does not allow.
 */
import Fastify from 'fastify'
import { describe, expect, it } from 'vitest'
import { chatBodySchema, completionBodySchema } from '../../daemon/ingress/schemas.ts'

describe('the ingress body schemas', () => {
  it.each([['chat', chatBodySchema], ['completions', completionBodySchema]])('%s: valid JSON Schema', async (_name, schema) => {
    const app = Fastify({ logger: false })
    app.post('/x', { schema: { body: schema } }, async () => ({}))
    await expect(app.ready()).resolves.toBeDefined()
    await app.close()
  })

  it('a schema only the meta-schema refuses fails that check', async () => {
    // A negative maxProperties compiles without the meta-schema check (as the ingress compiles).
    const app = Fastify({ logger: false })
    app.post('/x', { schema: { body: { ...completionBodySchema, maxProperties: -1 } } }, async () => ({}))
    await expect(app.ready()).rejects.toThrow(/schema/i)
    await app.close().catch(() => {})
  })
})
