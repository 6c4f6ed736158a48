import random, sys
random.seed(int(sys.argv[1]) if len(sys.argv)>1 else 1)
N=int(sys.argv[2]) if len(sys.argv)>2 else 3000
pools = {
 'ascii': [chr(c) for c in range(0x20,0x7f)],
 'letters': list('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ'),
 'words': ['the','The',' quick','brown','fox','Hello','world','HTTP','don',"n't","'s","'S","'re","'RE","'ll","'LL","'ve","'d","'D","'m","'t","'T",'\'x','"','``',"''",'...','--','->','=>','::','#!','/*','*/','<!--','-->','&amp;','https://','www.','.com','@user','#tag','$100','%d','{}','[]','()','\\n','\\\\'],
 'ws': [' ','  ','   ','\t','\n','\r','\r\n','\n\n','\x0b','\x0c','\u00a0','\u2000','\u2009','\u200a','\u2028','\u2029','\u202f','\u205f','\u3000','\u1680','\u0085',' '*8,'\n'*5,'\t\t',' \n',' \t ','\n \n'],
 'digits': list('0123456789')+['12','345','6789','3.14','1e-9','-42','1,000','٣','٤٥','۱۲','०१२','²','³','¹','½','¾','Ⅻ','ⅷ','①','⑳','０','１２','𝟙','𝟚','〇','六'],
 'latin': list('éèêëàâäôöûüçñÉÀÇÑßøØåÅæÆœŒłŁđĐğĞşŞıİžŽčČřŘ') + ['e\u0301','a\u0300','n\u0303','o\u0308','ﬁ','ﬂ','Ω','K','Å','ǅ','ǈ','ᾈ'],
 'marks': ['\u0300','\u0301','\u0302','\u0303','\u0308','\u0327','\u0338','\u034f','\u0351','\u0358','\u20dd','\u20e3','\u0483','\u05b4','\u064b','\u0e31','\u093f','\u094d','\u0b3c','\u1ab0','\ufe20'],
 'invisible': ['\u200b','\u200c','\u200d','\u2060','\ufeff','\u00ad','\u180e','\u061c','\u200e','\u200f','\u202a','\u202e','\u2066','\u2069','\ufe0f','\ufe0e','\U000e0001','\U000e0067'],
 'cjk': list('你好世界今天天气很好中文字符漢字龥一丁') + list('こんにちはカタカナひらがなーヴ') + list('안녕하세요세계한국어') + ['\U00020000','\U0002a6d6','\U0002ebf0','\u3400','\uf900','\u3002','\u3001','\uff0c','\uff01','\u300c','\u300d','\u30fb','\uff21','\uff41','\uff10'],
 'scripts': list('مرحبابالعالم') + list('שלוםעולם') + list('नमस्तेदुनिया') + list('สวัสดีชาวโลก') + list('ПриветмирЁё') + list('ΓειασουκόσμεΣς') + list('ሰላምԱրամ') + list('ᚠᚢᚦ'),
 'emoji': ['😂','🍕','🔥','👍','👍🏽','👋🏿','🎉','❤','❤️','☺','✨','⭐','🏳️\u200d🌈','👨\u200d👩\u200d👧\u200d👦','🇫🇷','🇺🇸','🏴\U000e0067\U000e0062\U000e0065\U000e006e\U000e0067\U000e007f','1️⃣','#️⃣','©','®','™','🤖','🧑\u200d💻','🫠','🪿'],
 'symbols': list('€£¥¢₹₿©®™°±×÷←→↑↓∑∏√∞≈≠≤≥∂∫∆∇⊂⊃∈∉∀∃¬∧∨⊕⊗§¶†‡•‣※‰′″‴№℃℉') + ['\u2427','\u31ef','\u2e80'],
 'punct': list('!"#%&\'()*,-./:;?@[\\]_{}¡¿«»‹›“”‘’„‚—–‐‑‒―…·•⁂⸮、。，！？：；（）【】《》〈〉「」『』〔〕・'),
 'odd': ['\ue000','\uf8ff','\U000f0000','\U0010fffd','\u0378','\u0380','\ufdd0','\ufffe','\uffff','\U0001fffe','\U0010ffff','\u0897','\u1c89','\U00013460','\U0001fa89','\x00','\x01','\x1b','\x7f','\x1c','\x1f','\u0080','\u009f','\ufffd'],
}
specials = ['<|im_start|>','<|im_end|>','<|endoftext|>','<reponame>','<repo_name>','<file_sep>','<|im_start|','<|im_','im_end|>','<<|im_end|>>','<|im_start|><|im_end|>',
            '<bos>','<eos>','<pad>','<unk>','<mask>','<start_of_turn>','<end_of_turn>','<start_of_image>','<end_of_image>','[multimodal]','<unused0>','<unused99>','<unused6241>','<unused62411>','</s>','<s>','<table>','<td>','</td>','<h1>','<tr>','<start_of_turn','<end_of_turn>>','<<eos>','\n\n\n','  ','\t\t\t', '<unused5><unused6>','<br>','<p>','<div>']
def rnd_piece():
    r=random.random()
    if r<0.08: return random.choice(specials)
    k=random.choice(list(pools))
    p=random.choice(pools[k])
    if random.random()<0.1: p=p*random.randint(2,12)
    return p
texts=set()
out=[]
def add(t):
    if t not in texts:
        texts.add(t); out.append(t)
# structured
for n in range(1,70): add(' '*n); add('\n'*n); add('\t'*n); add('x'+' '*n+'y'); add('x'+'\n'*n+'y'); add(' '*n+'x'); add('x'+' '*n); add('\r\n'*n); add(' \n'*n+'z'); add('a'+'\u00a0'*n+'b'); add('1'*n); add('é'*n)
for w in pools['words']:
    for w2 in pools['words'][:20]: add(w+w2)
while len(out)<N:
    k=random.randint(1,12)
    add(''.join(rnd_piece() for _ in range(k)))
sys.stdout.write(''.join(t.encode('utf-8').hex()+'\n' for t in out))
