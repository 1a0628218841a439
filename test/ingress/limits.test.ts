/** The ingress's limits have one table of defaults, and each is the caller's to set. */
import { describe, expect, it } from 'vitest'
import { createIngress, DEFAULT_INGRESS_LIMITS } from '../../daemon/ingress/index.ts'
import { createSimulatedService } from '../support/simulated-service.ts'

describe('ingress limits', () => {
  it('the time to receive a whole request is receiveTimeoutMs: 120 s unless set', async () => {
    const service = createSimulatedService({ models: [{ id: 'sim' }] })
    expect(DEFAULT_INGRESS_LIMITS.receiveTimeoutMs).toBe(120_000)
    const plain = createIngress({ logger: false }, { service })
    const set = createIngress({ logger: false, receiveTimeoutMs: 5_000, bodyLimitBytes: 4_096 }, { service })
    try {
      expect(plain.app.server.requestTimeout).toBe(120_000)
      expect(plain.app.initialConfig.bodyLimit).toBe(DEFAULT_INGRESS_LIMITS.bodyLimitBytes)
      expect(set.app.server.requestTimeout).toBe(5_000)
      expect(set.app.initialConfig.bodyLimit).toBe(4_096)
    } finally {
      await plain.app.close()
      await set.app.close()
    }
  })
})
