/**
 * 429s carry the overloaded component's own wait estimate as Retry-After (whole seconds, at least
 * 1) and as retry-after-ms (the estimate itself, which the openai SDKs honour).
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest'
import { createIngress, type Ingress } from '../../daemon/ingress/index.ts'
import { ShoalError } from '../../daemon/errors.ts'
import type { InferenceService } from '../../daemon/service.ts'

class Overloaded extends ShoalError {
  override name = 'Overloaded'
  readonly retryAfterMs: number
  constructor (retryAfterMs: number) {
    super('SHOAL_ERR_OVERLOADED', 'queue full')
    this.retryAfterMs = retryAfterMs
  }
}

describe('Retry-After', () => {
  let wait = 2500
  const service: InferenceService = {
    models: () => [{ id: 'm', created: 0, ownedBy: 'test', contextLength: 64 }],
    async * generate () { throw new Overloaded(wait) },
  }
  let ingress: Ingress
  beforeAll(async () => {
    ingress = createIngress({ logger: false }, { service })
    await ingress.app.ready()
  })
  afterAll(async () => { await ingress.stop() })

  const ask = async () => await ingress.app.inject({ method: 'POST', url: '/v1/completions', payload: { model: 'm', prompt: 'x' } })

  it('rounds the estimate up to whole seconds', async () => {
    wait = 2500
    const res = await ask()
    expect(res.statusCode).toBe(429)
    expect(res.headers['retry-after']).toBe('3')
    expect(res.headers['retry-after-ms']).toBe('2500')
  })

  it('never says less than one second', async () => {
    wait = 10
    const res = await ask()
    expect(res.statusCode).toBe(429)
    expect(res.headers['retry-after']).toBe('1')
    expect(res.headers['retry-after-ms']).toBe('10')
  })
})
