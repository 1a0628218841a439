import { describe, expect, it } from 'vitest'
import { createStartup } from '../../daemon/node/lifecycle.ts'
import type { Part } from '../../daemon/node/lifecycle.ts'

describe('lifecycle', () => {
  it('starts in order and stops in reverse', async () => {
    const log: string[] = []
    const part = (name: string): Part => ({ name, start: async () => { log.push(`start ${name}`) }, stop: async () => { log.push(`stop ${name}`) } })
    const startup = createStartup(() => {})
    for (const name of ['a', 'b', 'c']) await startup.start(part(name))
    await startup.stop()
    expect(log).toEqual(['start a', 'start b', 'start c', 'stop c', 'stop b', 'stop a'])
  })

  it('hands each part\'s products to the caller, typed, for the parts after it', async () => {
    const startup = createStartup(() => {})
    const { n } = await startup.start({ name: 'a', start: async () => ({ n: 41 }), stop: async () => {} })
    const m = await startup.start({ name: 'b', start: async () => n + 1, stop: async () => {} })
    expect(m).toBe(42)
  })

  it('unwinds what started when a part fails, and reports stop errors without throwing', async () => {
    const log: string[] = []
    const errors: string[] = []
    const startup = createStartup((name) => { errors.push(name) })
    await startup.start({ name: 'a', start: async () => { log.push('start a') }, stop: async () => { log.push('stop a') } })
    await startup.start({ name: 'b', start: async () => { log.push('start b') }, stop: async () => { throw new Error('b will not stop') } })
    await expect(startup.start({ name: 'c', start: async () => { throw new Error('c failed') }, stop: async () => { log.push('stop c') } })).rejects.toThrow('c failed')
    expect(log).toEqual(['start a', 'start b', 'stop a'])
    expect(errors).toEqual(['b'])
  })
})
