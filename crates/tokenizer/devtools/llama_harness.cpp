// Reads lines of hex-encoded UTF-8 texts; for each prints one line:
// ids for (add,parse) = (0,0) (0,1) (1,0) (1,1) separated by '|', then '|' hex of
// detokenize(ids(0,1), remove_special=false, unparse_special=true), then '|' hex of
// detokenize(ids(1,1), remove_special=true, unparse_special=false).
#include "llama.h"
#include <cstdio>
#include <string>
#include <vector>
#include <iostream>
static std::string unhex(const std::string& h){std::string s;for(size_t i=0;i+1<h.size();i+=2)s.push_back((char)std::stoi(h.substr(i,2),nullptr,16));return s;}
static std::string hex(const std::string& s){static const char*d="0123456789abcdef";std::string h;for(unsigned char c:s){h.push_back(d[c>>4]);h.push_back(d[c&15]);}return h;}
static void quiet(ggml_log_level, const char*, void*){}
int main(int argc,char**argv){
  llama_log_set(quiet,nullptr);
  llama_backend_init();
  auto mp=llama_model_default_params(); mp.vocab_only=true;
  llama_model*m=llama_model_load_from_file(argv[1],mp);
  if(!m){fprintf(stderr,"load failed\n");return 1;}
  const llama_vocab*v=llama_model_get_vocab(m);
  std::string line;
  auto tok=[&](const std::string&t,bool a,bool p){std::vector<llama_token> ids(t.size()+8);int n=llama_tokenize(v,t.data(),t.size(),ids.data(),ids.size(),a,p);if(n<0){ids.resize(-n);n=llama_tokenize(v,t.data(),t.size(),ids.data(),ids.size(),a,p);}ids.resize(n);return ids;};
  auto detok=[&](const std::vector<llama_token>&ids,bool rs,bool us){std::string b(ids.size()*64+16,'\0');int n=llama_detokenize(v,ids.data(),ids.size(),b.data(),b.size(),rs,us);if(n<0){b.resize(-n);n=llama_detokenize(v,ids.data(),ids.size(),b.data(),b.size(),rs,us);}b.resize(n);return b;};
  while(std::getline(std::cin,line)){
    std::string t=unhex(line);
    std::vector<llama_token> keep01, keep11;
    for(int c=0;c<4;c++){bool a=c>>1,p=c&1;auto ids=tok(t,a,p);if(c==1)keep01=ids;if(c==3)keep11=ids;for(size_t i=0;i<ids.size();i++)printf(i?",%d":"%d",ids[i]);printf("|");}
    printf("%s|%s\n",hex(detok(keep01,false,true)).c_str(),hex(detok(keep11,true,false)).c_str());
  }
  return 0;
}
