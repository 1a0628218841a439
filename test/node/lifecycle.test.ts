import { describe, expect, it } from 'vitest'
import { createLifecycle } from '../../daemon/node/lifecycle.ts'

describe('lifecycle', () => {
  it('starts in order and stops in reverse', async () => {
    const log: string[] = []
    const part = (name: string) => ({ name, start: async () => { log.push(`start ${name}`) }, stop: async () => { log.push(`stop ${name}`) } })
    const lc = createLifecycle([part('a'), part('b'), part('c')], () => {})
    await lc.start()
    await lc.stop()
    expect(log).toEqual(['start a', 'start b', 'start c', 'stop c', 'stop b', 'stop a'])
  })

  it('unwinds what started when a part fails, and reports stop errors without throwing', async () => {
    const log: string[] = []
    const errors: string[] = []
    const lc = createLifecycle([
      { name: 'a', start: async () => { log.push('start a') }, stop: async () => { log.push('stop a') } },
      { name: 'b', start: async () => { log.push('start b') }, stop: async () => { throw new Error('b will not stop') } },
      { name: 'c', start: async () => { throw new Error('c failed') }, stop: async () => { log.push('stop c') } },
    ], (name) => { errors.push(name) })
    await expect(lc.start()).rejects.toThrow('c failed')
    expect(log).toEqual(['start a', 'start b', 'stop a'])
    expect(errors).toEqual(['b'])
  })
})
